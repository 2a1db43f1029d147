"""Learner -> generator weight broadcast: bucketing, sender/receiver interface, backends."""
