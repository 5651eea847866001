"""The calculator tool: exact arithmetic, and hostile or huge expressions refused before computing."""

from __future__ import annotations

import re

import pytest

from services.env.tools.calculator import MAX_DIGITS, CalculatorError, calculator


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("1 + 2", "3"),
        ("0.1 + 0.2", "0.3"),  # exact, not 0.30000000000000004
        (
            "123456789123456789123456789 * 987654321987654321",
            str(123456789123456789123456789 * 987654321987654321),
        ),
        ("2 ** 100", str(2**100)),
        ("2 ** -2", "0.25"),
        ("(1.5 + 2) ** 3", "42.875"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("-(3 - 5)", "2"),
        ("1_000 * 3", "3000"),
        ("1.5e2", "150"),
        ("10 / 4", "2.5"),
        ("1 / 3", "1/3 (≈ 0.333333333333333333333333333333)"),
        ("1" + "+1" * 400, "401"),
    ],
)
def test_exact_results(expression: str, result: str) -> None:
    assert calculator(expression) == result


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9**9", f"more than {MAX_DIGITS} digits"),
        ("10**" + str(MAX_DIGITS), f"more than {MAX_DIGITS} digits"),
        ("1e999999999", f"more than {MAX_DIGITS} digits"),
        ("(10**2000) * (10**2001)", f"more than {MAX_DIGITS} digits"),
        ("2 ** 0.5", "whole-number exponents"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ^ 10", "use ** (for example 2**10)"),
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j", "only numbers are allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 +", "not a valid expression"),
        ("(" * 300 + "1" + ")" * 300, "not a valid expression"),
        ("1" * 2000, "longer than 1000 characters"),
    ],
)
def test_refusals_say_why(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=re.escape(message)):
        calculator(expression)
