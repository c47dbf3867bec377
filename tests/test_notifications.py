"""A failed campaign is announced through the user's Prefect notification block: campaign, stage, run folder.

The automation path (failed campaign -> reconcile -> block -> webhook) runs in
`tests/test_server.py::test_a_failed_campaign_triggers_reconcile_through_the_automation`.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from jex.flows.reconcile import failure_notice
from jex.infra.records import ReconciledMachine, ReconcileReport


class Hook:
    """A webhook on 127.0.0.1 that keeps every JSON body posted to it."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_the_notice_names_the_campaign_the_failed_stage_and_the_run_folder(tmp_path):
    from jex.run_records import RunStages, StageRecord
    from jex.tasks.campaign_spec import CampaignSpec

    spec = CampaignSpec(name="nightly", out=str(tmp_path / "runs"), store=str(tmp_path / "store"))
    run_dir = spec.run_dir()
    run_dir.mkdir(parents=True)
    RunStages({s: StageRecord(key="k", folder=str(tmp_path / "store" / s / "k")) for s in ("bundle", "fast_pass")}
              ).write(run_dir)
    subject, body = failure_notice({"spec": spec.model_dump(mode="json")}, "Failed", "boom", "tidy-otter",
                                   ReconcileReport(machines=[ReconciledMachine(machine=m, campaign="nightly",
                                                                               action="orphan") for m in "ab"]))
    assert subject == "jex: campaign nightly failed at stage gate"
    assert f"run folder: {run_dir.resolve()}" in body and "machines reconciled: 2" in body and "boom" in body


def test_a_webhook_notification_block_delivers_it_to_the_webhook():
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    hook = Hook()
    try:
        block = CustomWebhookNotificationBlock(name="jex", url=hook.url, allow_private_urls=True,
                                               json_data={"subject": "{{subject}}", "text": "{{body}}"})
        block.notify(body="campaign nightly failed at stage gate", subject="jex: campaign nightly failed")
    finally:
        hook.close()
    assert hook.received == [{"subject": "jex: campaign nightly failed",
                              "text": "campaign nightly failed at stage gate"}]
