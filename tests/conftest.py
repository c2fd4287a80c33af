"""Test-wide settings."""

import torch

# Two cores, several processes per test at times: one thread per process avoids
# oversubscription, which made small models an order of magnitude slower.
torch.set_num_threads(1)
