"""An exact calculator tool: + - * / // % ** and parentheses over integers and decimals.

The expression is parsed with `ast` and only whitelisted nodes are evaluated (numbers, the operators
above, unary + and -), with exact rational arithmetic (`fractions.Fraction`): decimals are read from
their source text, never through a float. Sizes are bounded before they are computed: an expression of
at most `MAX_EXPRESSION_CHARS` characters, numbers of at most `MAX_DIGITS` digits, and a power is
refused when its result would exceed that (so `9**9**9` is refused at once instead of computed).
"""

from __future__ import annotations

import ast
import math
from decimal import Decimal, localcontext
from fractions import Fraction

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 4000  # below Python's int-to-str limit (4300)
_MAX_BITS = int(MAX_DIGITS * math.log2(10))
_APPROX_DIGITS = 30


class CalculatorError(ValueError):
    """The expression is not one the calculator evaluates (the message says why)."""


def _check_size(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise CalculatorError(f"a number in the computation has more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are exact; got a fractional exponent")
    n = exponent.numerator
    if base == 0 and n < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    if abs(base.numerator) > 1 or base.denominator > 1:
        bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
        if (bits - 1) * abs(n) > _MAX_BITS:
            raise CalculatorError(f"the power's result would have more than {MAX_DIGITS} digits")
    elif abs(n) > 10**9:  # 0, 1 and -1 to any power are small, but keep the exponent sane
        raise CalculatorError("the exponent is too large")
    return _check_size(base**n)


def _literal(node: ast.Constant, source: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"only numbers are allowed, got {value!r}")
    text = ast.get_source_segment(source, node) or repr(value)
    text = text.replace("_", "")
    if len(text) > MAX_DIGITS:
        raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
    mantissa, _, exponent = text.lower().partition("e")
    if (
        exponent
        and not mantissa.startswith(("0x", "0o", "0b"))
        and (not exponent.lstrip("+-").isdigit() or abs(int(exponent)) > MAX_DIGITS)
    ):
        raise CalculatorError(f"the number {text[:40]!r} has more than {MAX_DIGITS} digits")
    try:
        exact = Fraction(text)
    except ValueError:  # 0x10, 0o7, 0b1: Python's own integer literals
        if not isinstance(value, int):
            raise CalculatorError(f"cannot read the number {text[:40]!r} exactly") from None
        exact = Fraction(value)
    return _check_size(exact)


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
    ast.Pow: _power,
}
_HINTS = {ast.BitXor: "'^' is not a power here; use ** (for example 2**10)"}


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, source)
    if isinstance(node, ast.Constant):
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        operation = _BINARY.get(type(node.op))
        if operation is None:
            hint = _HINTS.get(type(node.op), f"the operator {type(node.op).__name__} is not supported")
            raise CalculatorError(f"{hint}; use + - * / // % ** and parentheses")
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalculatorError("division by zero")
        return _check_size(operation(left, right))
    raise CalculatorError(
        f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses only"
    )


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    with localcontext() as context:
        context.prec = MAX_DIGITS + 10
        if denominator == 1:  # a terminating decimal: exact
            exact = Decimal(value.numerator) / Decimal(value.denominator)
            return format(exact.normalize(), "f")
        context.prec = _APPROX_DIGITS
        approx = Decimal(value.numerator) / Decimal(value.denominator)
    return f"{value.numerator}/{value.denominator} (≈ {format(approx, 'f')})"


def evaluate(expression: str) -> Fraction:
    """The exact value of an expression; raises CalculatorError saying what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid expression: {getattr(e, 'msg', None) or e}") from None
    try:
        return _evaluate(tree, source)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Supports + - * / // % ** and parentheses over integers and decimals, with exact results of up to
    4000 digits. A non-terminating fraction is given as a/b with a decimal approximation.

    Args:
        expression: The expression, for example "123456789 * 987654321" or "(1.5 + 2) ** 3".
    """
    return _format(evaluate(expression))
