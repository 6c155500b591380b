"""Scheduling pieces both node roles share: budgets, batch building, stop checks."""
