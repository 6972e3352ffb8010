import pytest

from minipar.worked import held, rounding_of


def test_the_rounding_is_half_the_last_written_digit():
    assert rounding_of("122") == 0.5
    assert rounding_of("121.7") == pytest.approx(0.05)
    assert rounding_of("190,000") == 0.5
    assert rounding_of("8.4e22") == pytest.approx(0.05e22)


def test_a_figure_within_its_rounding_is_held_and_printed(capsys):
    assert held(121.65, "121.7", "days on 64 GPUs") == 121.65
    assert capsys.readouterr().out == "days on 64 GPUs = 121.7\n"
    held(8.4e22, "8.4e22", "FLOPs")
    held(189_999.6, "190,000", "tokens/s")


@pytest.mark.parametrize("value, stated", [(121.76, "121.7"), (123.0, "122"), (float("nan"), "1")])
def test_a_wrong_figure_fails_naming_both_numbers(value, stated):
    with pytest.raises(AssertionError, match=f"the lesson says {stated}"):
        held(value, stated, "x")


def test_a_stated_figure_that_is_not_a_number_gets_one_clear_line():
    with pytest.raises(ValueError, match="not a figure"):
        held(1.0, "about 1", "x")
