"""--model-wait: a container started before its model is mounted says so once and waits, rather than
exiting into its restart policy's loop; with a bound it fails with exit 2 and the same clear words."""

from __future__ import annotations

import threading
import time

from nanoplane.cli import main, wait_for_model


def test_a_missing_model_fails_after_the_wait_with_a_clear_message(tmp_path, capsys):
    start = time.monotonic()
    code = main(["controlplane", "--model", str(tmp_path / "absent"), "--model-wait", "0.3"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start >= 0.3
    assert "no model at" in err and "NANOPLANE_MODEL_DIR" in err and "waited 0.3 s" in err, err
    assert "Traceback" not in err


def test_the_wait_ends_when_the_model_appears(tmp_path, capsys):
    model = tmp_path / "model"
    timer = threading.Timer(0.3, lambda: (model.mkdir(), (model / "config.json").write_text("{}")))
    timer.start()
    start = time.monotonic()
    wait_for_model(str(model), -1, poll_s=0.05)  # forever, as the images ask: it returns once the folder is there
    assert 0.3 <= time.monotonic() - start < 10
    assert capsys.readouterr().err.count("no model at") == 1  # said once, not once per poll


def test_no_wait_and_a_present_model_say_nothing(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    wait_for_model(str(tmp_path), -1)
    wait_for_model(str(tmp_path / "absent"), 0)  # the default: the command itself reports the missing folder
    assert capsys.readouterr().err == ""
