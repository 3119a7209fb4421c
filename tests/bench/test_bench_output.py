"""What foretell bench shows (issue 33, item 9): one colour and marker per acceptance series, the
prediction formulas spelled out in the plot and under the table, and log lines printed above the
progress bar, not into it."""

from __future__ import annotations

import logging
import sys

import pytest

from foretell.bench.plots import acceptance_figure, predicted_figure
from foretell.bench.report import sweep_summary
from foretell.progress import progress_bar


def spec_row(method, k, speedup, predicted, step_model, accepted):
    return dict(method=method, k=k, batch_size=1, tokens_per_s=100 * speedup, speedup=speedup,
                predicted_speedup=predicted, predicted_speedup_step_model=step_model,
                accepted_per_position=accepted, num_drafts=10)


REPORT = {
    "model": "m", "device": "cpu", "dtype": "float32", "batch_sizes": [1],
    "dataset": {"name": "gsm8k", "num_prompts": 1, "mean_prompt_tokens": 10.0, "max_tokens": 4,
                "temperature": 0.0},
    "results": [
        dict(method="none", k=0, batch_size=1, tokens_per_s=100.0, speedup=1.0),
        spec_row("eagle3", 1, 1.5, 1.6, 1.55, [7]),
        spec_row("eagle3", 3, 1.9, 2.1, 2.0, [7, 5, 3]),
        spec_row("ngram", 3, 1.2, 1.3, 1.25, [4, 2, 1]),
    ],
}


def test_each_acceptance_series_has_its_own_colour_and_marker():
    from matplotlib.colors import to_hex

    (ax,) = acceptance_figure(REPORT).axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["eagle3 k=1", "eagle3 k=3", "ngram k=3"]
    assert len({to_hex(line.get_color()) for line in lines}) == 3
    assert len({line.get_marker() for line in lines}) == 3
    assert list(lines[1].get_ydata()) == pytest.approx([0.7, 0.5, 0.3])


def test_prediction_formula_is_spelled_out():
    fig = predicted_figure(REPORT)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "eagle3: acceptance model" in labels and "ngram: step model" in labels
    assert not any(label.endswith("L / (1 + k c)") for label in labels)  # no bare formula
    note = fig.get_supxlabel()
    assert "L / (1 + k c)" in note and "L = mean acceptance length" in note
    assert "draft step time / verify step time" in note
    text = sweep_summary(REPORT)
    assert "predicted = L / (1 + k c): L the mean acceptance length" in text


def test_log_lines_print_above_the_progress_bar(capsys):
    handler = logging.StreamHandler(sys.stderr)  # what logging.basicConfig (foretell's CLI) installs
    logging.root.addHandler(handler)
    logger = logging.getLogger("foretell.test_progress")
    logger.setLevel(logging.INFO)
    try:
        with progress_bar(3, "bench", unit="req") as bar:
            bar.update(1)
            logger.info("loading the next configuration")
            bar.update(1)
        assert handler in logging.root.handlers  # the console handler is back after the bar
        logger.info("after the bar")
    finally:
        logging.root.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    err = capsys.readouterr().err
    at = err.index("loading the next configuration")
    # tqdm.write clears the bar's line first: the message starts a line of its own ("\r"
    # after the blanks), where a plain handler would have written it after the bar's text.
    assert err[at - 1] in "\r\n", repr(err[max(0, at - 80): at + 10])
    assert "after the bar\n" in err
    assert "bench:" in err


def test_a_disabled_bar_prints_nothing(capsys):
    with progress_bar(2, "bench", enabled=False) as bar:
        bar.update(2)
    assert capsys.readouterr().err == ""
