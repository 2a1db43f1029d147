"""Learner interface, backends, losses and advantage estimators."""
