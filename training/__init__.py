"""Everything that exists only while a model trains: the LightningModules, the non-finite
guard, callbacks, resuming, durable checkpoint writes. Lightning and W&B live here (and in
train.py), never in model/ or data/."""

import warnings

# Lightning 2.6 calls a torch pytree API that torch deprecates: a warning about Lightning's code
# that a user can do nothing about, printed by every run whose batches are dicts.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

# Under DDP, Lightning advises sync_dist=True for every metric logged at a validation's end. Ours
# are reduced over the ranks already (torchmetrics sums, synced as they are computed, and values
# every rank computes alike), so each validation of every run of several processes printed one
# piece of advice per metric that a user could only follow by adding a needless all-reduce.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/")
