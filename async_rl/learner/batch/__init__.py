"""The learner's batch layout: how a shard of trajectory groups becomes micro-batches. Packing samples
into rows (`packing.py`), one prompt per group shared by its completions (`shared_prefix.py`), the
padded layout (`padded.py`) and the token budget of a micro-batch (`token_budget.py`)."""
