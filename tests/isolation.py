"""Names a test gives to what it makes outside its own process, unique to the test
process: several test processes run at once (``pytest -n``), and a test that checks that
its run left no shared-memory file behind must not see another process's live ones."""

from __future__ import annotations

import os

RUN_ID = f"test-{os.getpid()}"
