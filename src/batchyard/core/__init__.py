"""The core every front door stands on: accounts, ledger, catalog, limits, clock."""
