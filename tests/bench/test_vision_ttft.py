"""`python3 -m bench.vision_ttft` runs (one repeat) and reports a row per image count, each prompt
with images timed against a text-only prompt of its token count."""

from __future__ import annotations

from bench import vision_ttft


def test_vision_figures_run(capsys):
    *rows, turn = vision_ttft.main(["--repeats", "1"])
    assert [r["images"] for r in rows] == [1, 2, 4]
    assert [r["prompt_tokens"] for r in rows] == sorted(r["prompt_tokens"] for r in rows)
    assert rows[2]["prompt_tokens"] - rows[0]["prompt_tokens"] == 3 * 22  # 16 soft tokens and 6 markers an image
    assert all(r["encoder_ms_per_image"] > 0 and r["ttft_text_ms"] > 0 for r in rows)
    assert turn["ttft_cached_image_ms"] > 0 and turn["ttft_new_image_ms"] > 0
    assert "| 4 |" in capsys.readouterr().out
