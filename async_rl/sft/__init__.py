"""Supervised fine-tuning (train.mode=sft): chat demonstrations (`data.py`, read by every learner
rank), the learner rank that trains on them (`learner.py`), and the run that trains the learner on
them alone (`runner.py`)."""
