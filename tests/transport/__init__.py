"""Tests of gpipe.transport, one module per module (a package: one name everywhere)."""
