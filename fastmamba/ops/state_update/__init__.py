from fastmamba.ops.state_update.api import selective_state_update

__all__ = ["selective_state_update"]
