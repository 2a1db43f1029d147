"""Fixtures and settings for every tier."""

from __future__ import annotations

import os

# A bare ray.init() joins the machine's running Ray cluster when there is one (a `ray start` head
# anywhere on the machine leaves its address in /tmp/ray/ray_current_cluster): the suite would then
# run on someone else's cluster and its resources. "local" always starts a fresh local Ray; a test that
# means a cluster passes its address explicitly. An address set by the caller is kept.
os.environ.setdefault("RAY_ADDRESS", "local")
