"""Talaria's scheduler: sessions, router, admission budget with soft reservations, model multiplexer.

Pure Python; it sees instances only through ``InstanceAPI`` and imports neither engine nor sim.
"""
from talaria_jax.scheduler.admission import AdmissionBudget, Reservation
from talaria_jax.scheduler.api import InstanceAPI, PrefixLocation, WeightState
from talaria_jax.scheduler.multiplexer import RoundMultiplexer, Slot
from talaria_jax.scheduler.policies import DEFAULT_POLICIES, POLICIES, PolicyConfig, RouterWeights, get_policy
from talaria_jax.scheduler.router import rank, talaria_score
from talaria_jax.scheduler.scheduler import Scheduler
from talaria_jax.scheduler.session import NO_HINTS, Call, Hints, Session, SessionTable

__all__ = [
    "AdmissionBudget", "Reservation", "InstanceAPI", "PrefixLocation", "WeightState", "RoundMultiplexer", "Slot",
    "DEFAULT_POLICIES", "POLICIES", "PolicyConfig", "RouterWeights", "get_policy", "rank", "talaria_score",
    "Scheduler", "Call", "Hints", "NO_HINTS", "Session", "SessionTable",
]
