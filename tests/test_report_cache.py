"""The report is a cached stage: keyed by the summaries it renders and the spec, found again in the run
folder, so an unchanged run renders nothing (tasks/outputs/run_folder.py, the report task)."""

from __future__ import annotations

from jex.tasks.campaign_spec import CampaignSpec
from jex.tasks.outputs.run_folder import RUN_FILES, mark_rendered, rendered, report_key
from jex.tasks.records import BundleSummary, CampaignSummaries, GateSummary


def _summaries(gate_sha: str = "12" * 32) -> CampaignSummaries:
    return CampaignSummaries(bundle=BundleSummary(key="kb", sha256="ab" * 32, bundle="b.tar.gz", rows=9),
                             gate=GateSummary(key="kg", sha256=gate_sha, gated="g.parquet", rows=3))


def test_report_key_follows_the_rendered_records_and_the_spec(tmp_path):
    key = report_key(tmp_path, _summaries(), CampaignSpec(name="c"))
    assert key == report_key(tmp_path, _summaries(), CampaignSpec(name="c"))
    assert key != report_key(tmp_path, _summaries(gate_sha="34" * 32), CampaignSpec(name="c"))  # other content
    assert key != report_key(tmp_path, _summaries(), CampaignSpec(name="c", coverage=0.2))
    (tmp_path / "spec_proof.json").write_text("{}")
    assert key != report_key(tmp_path, _summaries(), CampaignSpec(name="c"))  # a speculative proof beside it


def test_a_rendered_folder_is_found_only_whole_and_under_its_key(tmp_path):
    key = report_key(tmp_path, _summaries(), CampaignSpec(name="c"))
    for name in RUN_FILES:
        (tmp_path / name).write_text("x")
    assert not rendered(tmp_path, key)  # no marker: rendered by an older jex, or interrupted
    mark_rendered(tmp_path, key)
    assert rendered(tmp_path, key) and not rendered(tmp_path, "other")
    (tmp_path / "skill.png").unlink()
    assert not rendered(tmp_path, key)
