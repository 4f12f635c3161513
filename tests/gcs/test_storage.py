"""job/core/storage.py: run directory names, the writable check and its one-line errors, and the
gs:// stand-ins for append and rename, against the Cloud Storage emulator and a local disk."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from job.core import storage
from job.runtime import preflight
from tests.gcs_emulator import BUCKET, Emulator
from tests.launching import ROOT, child_env

pytestmark = pytest.mark.gcs


def check_run_dir(url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "job", "check-run-dir", url], env=child_env(**env), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("path", "remote", "bucket"), [
    ("gs://b-1/run", True, "b-1"), ("runs/x", False, ""), ("/abs/gs://x", False, ""), ("gs://b/a/b/c", True, "b"),
])
def test_remote_paths_and_their_bucket(path: str, remote: bool, bucket: str) -> None:
    assert storage.is_remote(path) is remote
    assert storage.bucket_of(path) == bucket


@pytest.mark.parametrize(("run_dir", "problem"), [
    ("runs/example", None), ("/abs/run", None), ("gs://my-bucket/run1", None), ("gs://a.b_c-d/x/y", None),
    ("s3://bucket/run", "only gs://"), ("gs://bucket", "bucket's root"), ("gs://bucket/", "bucket's root"),
    ("gs://ab/run", "3-63"), ("gs://" + "a" * 64 + "/run", "3-63"), ("gs://Caps/run", "lowercase"),
    ("gs://-dash/run", "starts and ends"), ("gs://googly/run", "goog"), ("gs://a..b/run", "'..'"),
])
def test_run_dir_names(run_dir: str, problem: str | None) -> None:
    found = storage.url_problem(run_dir)
    assert found is None if problem is None else problem in found, found


def test_local_paths_keep_their_form(tmp_path: Path) -> None:
    assert str(storage.run_path("runs/x")) == "runs/x"  # relative stays relative
    assert str(storage.run_path("gs://b/run") / "checkpoints") == "gs://b/run/checkpoints"
    assert storage.check_writable(tmp_path / "new" / "folder") is None
    assert list((tmp_path / "new" / "folder").iterdir()) == []  # the probe is gone
    (tmp_path / "file").write_text("x")
    error = storage.check_writable(tmp_path / "file" / "sub")
    assert error is not None and error.startswith("--run-dir: expected a folder the job can write, found ")
    assert "Fix:" in error and "\n" not in error


def test_check_writable_writes_and_deletes_a_probe_object(gcs_here: Emulator) -> None:
    assert storage.check_writable(f"gs://{BUCKET}/run1") is None
    assert gcs_here.objects("") == []  # written, then deleted


def test_a_missing_bucket_is_one_line_and_is_never_created(gcs_here: Emulator) -> None:
    error = storage.check_writable("gs://no-such-bucket/run1")
    assert error == (
        "--run-dir: expected a bucket the job can write, found gs://no-such-bucket/run1: bucket does not exist "
        "(404). Fix: create it (gcloud storage buckets create gs://no-such-bucket) or pass an existing bucket, "
        f"and grant {storage.BUCKET_ROLE} on it to the workers' service account")
    assert gcs_here.buckets() == [BUCKET]


def test_preflight_probe_and_shared_check_in_a_bucket(gcs_here: Emulator) -> None:
    folder = storage.run_path(f"gs://{BUCKET}/run1/checkpoints")
    assert preflight.writable(folder, 0, keep=True, token="run-b") == preflight.WRITABLE
    assert gcs_here.objects("") == ["run1/checkpoints/.preflight-0"]
    assert preflight.sees_process_0(folder, "run-b") == preflight.SHARED
    assert preflight.sees_process_0(folder, "run-c").startswith(
        "found a .preflight-0 that process 0 of this job did not write")
    preflight.remove_probe(folder, 0)
    preflight.remove_probe(folder, 0)  # already gone: no error
    assert gcs_here.objects("") == []
    assert preflight.sees_process_0(folder, "run-b").startswith("cannot see process 0's .preflight-0")
    missing = storage.run_path("gs://no-such-bucket/run1/checkpoints")
    assert preflight.writable(missing, 1) == "bucket does not exist (404)"


def test_preflight_report_for_a_bucket_no_process_can_write(gcs_here: Emulator) -> None:
    rows = [{"process": i, "host": "h", "run dir": "bucket does not exist (404)"} for i in range(2)]
    text = preflight.report(rows, preflight.problems(rows), storage.run_path("gs://nope/run/checkpoints"))
    assert text == ("preflight: stopping before training: all 2 process(es) cannot write the run dir. "
                    + storage.explain("gs://nope/run/checkpoints", "bucket does not exist (404)"))


def test_preflight_report_for_a_local_folder_keeps_its_table() -> None:
    rows = [{"process": i, "host": "h", "run dir": "OSError: Read-only file system"} for i in range(2)]
    text = preflight.report(rows, preflight.problems(rows), storage.run_path("/r/checkpoints"))
    assert text.startswith("preflight: stopping before training: 2 processes, these facts differ or fail.\n")
    assert text.endswith("Fix: make /r/checkpoints one folder every host can write (a filesystem they share), "
                         "or pass --run-dir")


def test_appender_keeps_what_was_there_and_rewrites_a_bucket_object_only_when_due(gcs_here: Emulator,
                                                                                   tmp_path: Path) -> None:
    gcs_here.write("run1/log.jsonl", b"zero\n")
    (tmp_path / "log.jsonl").write_text("zero\n")
    now = [0.0]
    remote = storage.Appender(storage.run_path(f"gs://{BUCKET}/run1") / "log.jsonl", every_s=30, clock=lambda: now[0])
    local = storage.Appender(storage.run_path(tmp_path) / "log.jsonl", every_s=30, clock=lambda: now[0])
    for out in (remote, local):
        out.write("one\n")
    assert (tmp_path / "log.jsonl").read_text() == "zero\none\n"  # a local file: at once
    assert gcs_here.read("run1/log.jsonl") == b"zero\n"  # an object: not rewritten at every line
    now[0] = 31.0
    remote.write("two\n")
    assert gcs_here.read("run1/log.jsonl") == b"zero\none\ntwo\n"  # due: rewritten whole
    remote.write("three\n")
    remote.close()
    local.close()
    assert gcs_here.read("run1/log.jsonl") == b"zero\none\ntwo\nthree\n"  # close writes out the rest


def test_move_aside_in_a_bucket_drops_the_commit_marker_first(gcs_here: Emulator) -> None:
    names = ["run1/checkpoints/8/commit_success.txt", "run1/checkpoints/8/default/d/abc",
             "run1/checkpoints/8/_CHECKPOINT_METADATA", "run1/checkpoints/4/commit_success.txt"]
    for name in names:
        gcs_here.write(name, name.encode())
    source = storage.run_path(f"gs://{BUCKET}/run1/checkpoints/8")
    storage.move_aside(source, source.with_name("8.unreadable-1"))
    assert sorted(gcs_here.objects("")) == [
        "run1/checkpoints/4/commit_success.txt",
        "run1/checkpoints/8.unreadable-1/_CHECKPOINT_METADATA",
        "run1/checkpoints/8.unreadable-1/default/d/abc",
    ]
    assert gcs_here.read("run1/checkpoints/8.unreadable-1/default/d/abc") == b"run1/checkpoints/8/default/d/abc"
    assert sorted(p.name for p in source.parent.iterdir()) == ["4", "8.unreadable-1"]  # no stale listing


def test_forget_listings_shows_what_another_process_changed(gcs_here: Emulator) -> None:
    gcs_here.write("run1/checkpoints/4/commit_success.txt", b"ok")
    folder = storage.run_path(f"gs://{BUCKET}/run1/checkpoints")
    assert [p.name for p in folder.iterdir()] == ["4"]  # gcsfs caches this listing
    gcs_here.write("run1/checkpoints/8/commit_success.txt", b"ok")  # another process's write
    storage.forget_listings(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["4", "8"]


def test_move_aside_on_a_disk_is_a_rename(tmp_path: Path) -> None:
    (tmp_path / "8" / "default").mkdir(parents=True)
    (tmp_path / "8" / "commit_success.txt").write_text("ok")
    storage.move_aside(storage.run_path(tmp_path / "8"), storage.run_path(tmp_path / "8.aside"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["8.aside"]
    assert (tmp_path / "8.aside" / "commit_success.txt").exists()


def test_check_run_dir_command_exit_codes(gcs: Emulator) -> None:
    ok = check_run_dir(f"gs://{BUCKET}/run1", gcs.env)
    assert ok.returncode == 0 and ok.stdout.strip() == f"gs://{BUCKET}/run1: writable", ok.stderr
    missing = check_run_dir("gs://no-such-bucket/run1", gcs.env)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("error: --run-dir: expected a bucket the job can write, found "
                                     "gs://no-such-bucket/run1: bucket does not exist (404). Fix: create it")
    assert len(missing.stderr.strip().splitlines()) == 1
    bad = check_run_dir("gs://Bad_Bucket/run1", gcs.env)
    assert bad.returncode == 2 and "lowercase" in bad.stderr and "Fix:" in bad.stderr
    usage = check_run_dir("", gcs.env)
    assert usage.returncode == 2
    assert gcs.objects("") == [] and gcs.buckets() == [BUCKET]


class _Refuses(http.server.BaseHTTPRequestHandler):
    """Cloud Storage as a service account without object permissions sees it: 403 to everything."""

    def _refuse(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = json.dumps({"error": {"code": 403, "message": "sa@p.iam.gserviceaccount.com does not have "
                                     "storage.objects.create access to the Google Cloud Storage object."}}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _refuse

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_endpoint(gcs: Emulator) -> Iterator[dict[str, str]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield {**gcs.env, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
    server.shutdown()
    server.server_close()


def test_a_bucket_without_write_permission_is_one_line_naming_the_role(refusing_endpoint: dict[str, str]) -> None:
    refused = check_run_dir(f"gs://{BUCKET}/run1", refusing_endpoint)
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip()
    assert line.startswith(f"error: --run-dir: expected a bucket the job can write, found gs://{BUCKET}/run1: "
                           "permission denied (403)"), line
    assert f"Fix: grant {storage.BUCKET_ROLE} on gs://{BUCKET}" in line and "\n" not in line
