"""A tool-use loop: the model picks a tool with select, the program runs it in Python and feeds back the result.

Reading `s["tool"]` waits for the select, so plain Python branches on the model's choice. The calculator's
expression is constrained by a regex and evaluated safely with ast (numbers and + - * / only).

Run: python examples/tool_use.py
"""

from __future__ import annotations

import ast
import operator

import furcate as sgl

PROMPT = """Pick a tool for each question: calculator for arithmetic, search for facts, answer when the result is known.

Question: What is 12 times 7?
Tool: calculator
Expression: 12 * 7
Result: 84
Tool: answer
Answer: 84

Question: Who painted the Mona Lisa?
Tool: search
Query: Mona Lisa painter
Result: The Mona Lisa was painted by Leonardo da Vinci.
Tool: answer
Answer: Leonardo da Vinci

Question: What is 150 divided by 6?
Tool: calculator
Expression: 150 / 6
Result: 25
Tool: answer
Answer: 25

"""
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
DOCUMENTS = {"eiffel": "The Eiffel Tower is 330 metres tall.", "python": "Python was created by Guido van Rossum."}


def calculate(expression: str) -> str:
    """Evaluate + - * / and parentheses over numbers (nothing else: no names, no calls) with ast."""
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("not arithmetic")
    try:
        return f"{walk(ast.parse(expression.strip(), mode='eval').body):.10g}"
    except (ValueError, SyntaxError, ZeroDivisionError) as error:
        return f"error: {error}"


def search(query: str) -> str:
    return next((text for key, text in DOCUMENTS.items() if key in query.lower()), "No results.")


@sgl.function
def tool_use(s, question):
    s += PROMPT + f"Question: {question}\n"
    for _ in range(3):  # at most three steps
        s += "Tool: " + sgl.select("tool", choices=["calculator", "search", "answer"]) + "\n"
        if s["tool"] == "calculator":  # reading a variable waits for it, so Python can branch on it
            # The regex admits arithmetic only; its closing newline lets the model say where it ends.
            s += "Expression: " + sgl.gen("expr", regex=r"[0-9+\-*/ ()]+\n", max_tokens=16, temperature=0)
            s += f"Result: {calculate(s['expr'])}\n"
        elif s["tool"] == "search":
            s += "Query:" + sgl.gen("query", stop="\n", max_tokens=12, temperature=0) + "\n"
            s += f"Result: {search(s['query'])}\n"
        else:
            s += "Answer:" + sgl.gen("answer", stop="\n", max_tokens=16, temperature=0)
            return


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)
        questions = ["What is 23 times 19?", "Who created Python?"]
        states = tool_use.run_batch([{"question": q} for q in questions])
        for question, state in zip(questions, states):
            print(f"== {question} ==")
            print(state.text()[len(PROMPT):].strip(), end="\n\n")


if __name__ == "__main__":
    main()
