"""What the engine reads: render settings, chat templates, few-shot examples, and their fingerprint."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jex.engine.render import DEFAULT_RENDER, Example, Renderer
from jex.engine_spec import RenderSpec
from jex.tasks.capture.engine_calls import CaptureRow, examples_for


def tagged(messages) -> str:
    """A chat function that shows every turn: enough to see what a template receives."""
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


ROW = {"run_id": "r1", "prompt": "Which is warm?", "labels": ("A", "B"), "options": ("ice", "fire")}


def test_default_render_is_the_model_chat_template_around_the_question_then_the_answer_slot(embedded_model_dir):
    from transformers import AutoTokenizer

    from jex.engine.base import ChatTokenizer

    engine = ChatTokenizer()
    engine.tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    user = "Which is warm?\n\nA. ice\nB. fire\n\nAnswer with the letter of the correct option."
    expected = engine.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                    add_generation_prompt=True) + "Answer:"
    assert engine.renderer(DEFAULT_RENDER).question(**ROW).prompt == expected
    assert engine.renderer(RenderSpec(chat_template="none")).question(**ROW).prompt == user + "\nAnswer:"


def test_system_prompt_and_few_shot_examples_become_turns_before_the_question():
    spec = RenderSpec(system_prompt="Be brief.", num_fewshot=1, question_template="Q: {prompt}\n{options}",
                      option_format="({label}) {option}")
    example = Example("Which is cold?", ("A", "B"), ("ice", "fire"), 0)
    text = Renderer(spec, tagged).question(**ROW, examples=[example]).prompt
    assert text == ("<system>Be brief.</system><user>Q: Which is cold?\n(A) ice\n(B) fire</user>"
                    "<assistant>Answer: A</assistant><user>Q: Which is warm?\n(A) ice\n(B) fire</user>"
                    "<assistant>Answer:")


def test_without_a_chat_template_examples_are_solved_paragraphs():
    spec = RenderSpec(chat_template="none", system_prompt="Be brief.", question_template="{prompt}\n{options}")
    example = Example("Which is cold?", ("A", "B"), ("ice", "fire"), 0)
    text = Renderer(spec, None).question(**ROW, examples=[example]).prompt
    assert text == "Be brief.\n\nWhich is cold?\nA. ice\nB. fire\nAnswer: A\n\nWhich is warm?\nA. ice\nB. fire\nAnswer:"


def test_few_shot_examples_come_in_order_from_the_rows_catalog_and_never_the_row_itself():
    pool = {"c": [CaptureRow("s1", "P1", ("A", "B"), ("x", "y"), 1, "c", "q1"),
                  CaptureRow("s2", "P2", ("A", "B"), ("x", "y"), 0, "c", "q2"),
                  CaptureRow("s3", "P3", ("A", "B"), ("x", "y"), 0, "c", "q3")]}
    row = CaptureRow("r", "Q", ("A", "B"), ("x", "y"), 0, "c", "q1")
    assert [e.prompt for e in examples_for(row, pool, 2)] == ["P2", "P3"]
    with pytest.raises(ValueError, match="catalog 'c' has 2 few-shot example"):
        examples_for(row, pool, 3)


@pytest.mark.parametrize("field, value, message", [
    ("question_template", "{prompt} {choices}", "placeholders ['options', 'prompt'], found ['choices', 'prompt']"),
    ("option_format", "{label}", "found ['label']"),
    ("reason_template", "{prompt", "not a format string"),
    ("num_fewshot", -1, "greater than or equal to 0"),
])
def test_a_bad_render_setting_is_refused_naming_it(field, value, message):
    with pytest.raises(ValidationError) as err:
        RenderSpec(**{field: value})
    assert err.value.errors()[0]["loc"] == (field,) and message in str(err.value)


def test_every_render_setting_changes_the_fingerprint_and_equal_settings_do_not():
    assert RenderSpec().digest() == DEFAULT_RENDER.digest()
    changed = [RenderSpec(system_prompt="x"), RenderSpec(chat_template="none"), RenderSpec(num_fewshot=2),
               RenderSpec(answer_slot="Answer: "), RenderSpec(option_format="{label}) {option}"),
               RenderSpec(reason_template="{prompt}{options}"), RenderSpec(after_thought="\nSo:"),
               RenderSpec(question_template="Q: {prompt}\n{options}")]
    prints = {s.digest()["sha256"] for s in changed} | {DEFAULT_RENDER.digest()["sha256"]}
    assert len(prints) == len(changed) + 1


def test_render_file_and_flags_build_one_spec_and_bad_files_name_the_field(tmp_path):
    from jex.cli import render_spec_from
    from jex.errors import InputError

    (tmp_path / "render.toml").write_text('system_prompt = "Be brief."\nanswer_slot = "Answer:"\n')
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    spec = render_spec_from(tmp_path / "render.toml", chat_template=str(tmp_path / "chat.jinja"), system_prompt=None,
                            num_fewshot=3)
    assert (spec.system_prompt, spec.num_fewshot, spec.chat_template.startswith("{% for")) == ("Be brief.", 3, True)
    (tmp_path / "bad.toml").write_text('question_template = "{question}"\n')
    with pytest.raises(InputError, match="field 'question_template'"):
        render_spec_from(tmp_path / "bad.toml", chat_template="auto", system_prompt=None, num_fewshot=0)
