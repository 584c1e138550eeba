"""The schedules' step orders, kept importable here: they live in :mod:`galva_comm.schedules`, which galva-search
also reads to price a schedule on processors that ranks share."""

from galva_comm.schedules import Step, schedule_order, simulate

__all__ = ["Step", "schedule_order", "simulate"]
