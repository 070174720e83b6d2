"""Idle-time prediction: the query predictor, the scheduler of idle rounds, the background
worker and what the user is doing (activity)."""
