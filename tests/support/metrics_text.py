"""A server's ``/metrics`` as a dict of samples keyed by ``name{labels}`` exactly as exposed (the server and
router tests read counters before and after a request and compare). Importable because
``tests/conftest.py`` puts this folder on ``sys.path``."""

from __future__ import annotations

import re

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(server) -> dict[str, float]:
    """Every sample of ``server.get("/metrics")``."""
    samples = {}
    for line in server.get("/metrics").text.splitlines():
        m = SAMPLE.match(line)
        if m:
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples
