"""The V4 network: rope, norms, mhc, compressor, indexer, attention, moe, mtp, block, model, weights."""

from v4stack.model.model import V4Model
from v4stack.model.state import RequestState, new_request_state

__all__ = ["V4Model", "RequestState", "new_request_state"]
