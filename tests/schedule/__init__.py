"""Tests of gpipe.schedule, one module per module (a package: one name everywhere)."""
