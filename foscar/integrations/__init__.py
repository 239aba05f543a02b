"""Integrations of the FOSCAR cache with model libraries; each imports its library lazily."""
