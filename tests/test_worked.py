import pytest

from minipar.worked import held, rounding_of, rounds_to


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


def test_rounds_to_is_the_prose_rounding_held_and_the_numerals_test_share():
    assert rounds_to(121.74, "121.7") and not rounds_to(121.76, "121.7")
    assert rounds_to(8.44e22, "8.4e22") and rounds_to(190_160, "1.9e5")
    assert not rounds_to(float("nan"), "1") and not rounds_to(float("inf"), "1")
