"""The SDK reads a job file before any call: a malformed file is a ValidationError naming the file and
the field (nothing is sent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spiderflow.core.errors import ValidationError
from spiderflow.sdk import Client


@pytest.mark.parametrize(("doc", "message"), [
    ({"jobs": 5}, "jobs: must be a list (got 5)"),
    ({"jobs": []}, "jobs: a job file must hold one job (use a trace for several) (got 0)"),
    ({"jobs": [{"id": "a"}]}, ": jobs[0].model: is required"),
    ({"id": "a", "model": "gpt-tiny", "global_batch": 8, "gpus": {"min": 3, "max": 2}}, ": gpus"),
    ([1, 2], "must be an object"),
])
def test_a_bad_job_file_names_the_file_and_the_field(doc: object, message: str, tmp_path: Path) -> None:
    f = tmp_path / "job.json"
    f.write_text(json.dumps(doc))
    client = Client("127.0.0.1:1")  # never reached: the file is rejected first
    try:
        with pytest.raises(ValidationError) as e:
            client.submit(f)
    finally:
        client.close()
    assert str(e.value).startswith(f"{f}")
    assert message in str(e.value)
