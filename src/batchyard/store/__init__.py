"""Durable state: tables, migrations and the queries each concept needs."""
