"""Everything that exists only while a model trains: the LightningModules, the non-finite
guard, callbacks, resuming, durable checkpoint writes. Lightning and W&B live here (and in
train.py), never in model/ or data/."""

import warnings

# Lightning 2.6 calls a torch pytree API that torch deprecates: a warning about Lightning's code
# that a user can do nothing about, printed by every run whose batches are dicts.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
