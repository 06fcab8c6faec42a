"""Everything that exists only while a model trains: the LightningModules, the non-finite
guard, callbacks, resuming, durable checkpoint writes. Lightning and W&B live here (and in
train.py), never in model/ or data/."""
