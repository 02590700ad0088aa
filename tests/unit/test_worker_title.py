"""runtime.worker.name_process: a worker is titled by its section and replica in ps and top."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/comm is Linux's")
@pytest.mark.parametrize(("label", "title"), [
    ("student/1", "mf student/1"),
    ("a_very_long_section_name/3", "mf a_very_lon/3"),  # the kernel keeps 15 bytes: the replica stays
    ("text_encoder/1/0", "mf text_enc/1/0"),
    ("tëacher/0", "mf tëacher/0"),
])
def test_a_worker_is_titled_by_its_label(label, title):
    code = ("import sys; from maestro_flow.runtime.worker import name_process; name_process(sys.argv[1]); "
            "print(open('/proc/self/comm').read().strip())")
    out = subprocess.run([sys.executable, "-c", code, label], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == title
