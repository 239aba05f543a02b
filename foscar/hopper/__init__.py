"""Hopper (sm_90a) fused decode attention over INT2/INT4 KV caches (CuTe DSL)."""
