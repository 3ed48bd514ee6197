"""Test support: a live server on loopback, fake upstreams, databases."""
