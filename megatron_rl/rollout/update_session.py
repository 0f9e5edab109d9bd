"""SGLang's weight-update sessions: every sync is begin -> transfer -> end on each server.

SGLang 0.5.23's scheduler (``srt/managers/scheduler_components/weight_updater.py``,
``SchedulerWeightUpdater``) refuses ``update_weights_from_distributed`` and
``update_weights_from_tensor`` (HTTP 400, ``success: false``, "... must run between
begin_weight_update() and end_weight_update()") unless ``POST /begin_weight_update`` opened a
session. ``POST /end_weight_update`` closes it (and runs the runners' post-load step when nothing
was loaded). A second begin while a session is open is refused ("a weight-update session is
already open"), and so is an end with none open. ``update_weights_from_disk`` needs no session.

Releases before sessions existed answer 404 on ``/begin_weight_update``: such a server is
remembered as session-less and its updates are sent as before (`UpdateSessions.begin` returns
False), so one client drives old and new servers side by side. A session left open by a trainer
that died mid-sync is closed and opened again (the sync that follows reloads every tensor).
"""

from __future__ import annotations

import logging

from megatron_rl.rollout.http_pool import ServerError

logger = logging.getLogger(__name__)

TRANSPORTS_NEEDING_SESSION = ("distributed", "tensor")
ALREADY_OPEN = "already open"  # SGLang's refusal of a second begin


class UpdateSessions:
    """Opens and closes weight-update sessions on the servers of ``pool`` (an `HttpPool`)."""

    def __init__(self, pool, *, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.has_sessions: dict[str, bool] = {}  # url -> whether it serves sessions

    def begin(self, url: str) -> bool:
        """Open a session on ``url``; False when the server has no sessions (404, an SGLang
        release before them). Raises RuntimeError when the server refuses twice."""
        if self.has_sessions.get(url) is False:
            return False
        try:
            self._post(url, "/begin_weight_update", {})
        except ServerError as err:
            if "HTTP 404" in str(err):
                self.has_sessions[url] = False
                logger.info("%s has no weight-update sessions (404): updates sent without", url)
                return False
            if ALREADY_OPEN not in str(err):
                raise
            logger.warning("%s: a weight-update session was left open; closing it first", url)
            self._post(url, "/end_weight_update", {})
            self._post(url, "/begin_weight_update", {})
        self.has_sessions[url] = True
        return True

    def end(self, url: str) -> None:
        """Close the session ``begin`` opened on ``url``; RuntimeError when it fails."""
        self._post(url, "/end_weight_update", {})

    def _post(self, url: str, path: str, payload: dict) -> None:
        answer = self.pool.call_on(url, "POST", path, payload, timeout_s=self.timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerError(f"POST {url}{path}: success=false: {answer.get('message')}")
