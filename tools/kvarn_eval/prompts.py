"""Instruction prompts for the greedy-generation and error-accumulation measurements.

Written for this project. Each asks for a long, open answer, so a 135M model's reply usually
runs for hundreds of tokens before it ends its turn, and covers prose, lists, code and
arithmetic, which stress different attention patterns.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ACCUMULATION_PROMPT", "PROMPTS"]

PROMPTS: Final[tuple[str, ...]] = (
    "Write a detailed essay about the history of the printing press and how it changed the "
    "way people in Europe shared ideas. Cover at least five separate consequences.",
    "Explain step by step how a refrigerator keeps food cold. Describe the role of the "
    "compressor, the condenser, the expansion valve and the evaporator.",
    "Write a Python function that reads a CSV file of sales records (date, region, amount), "
    "computes the total and average amount per region, and prints a sorted report. Then "
    "explain how the code works line by line.",
    "Give me a seven-day meal plan for a vegetarian who wants to eat more protein. For each "
    "day list breakfast, lunch, dinner and one snack, with a short reason for each choice.",
    "Tell a long story about a lighthouse keeper who finds a message in a bottle, and what "
    "happens when she decides to answer it.",
    "A train leaves a station at 9:00 travelling at 80 km/h, and a second train leaves the "
    "same station at 10:30 travelling at 120 km/h on the same track. Explain in detail when "
    "and where the second train catches up, showing every step of the calculation.",
    "Compare renewable energy sources: solar, wind, hydroelectric and geothermal. For each "
    "one discuss how it works, its advantages, its drawbacks and where it is used most.",
    "Write a beginner's guide to learning to play chess: the pieces and how they move, "
    "basic opening principles, common tactics, and advice for practising.",
)

#: The long trajectory of the error-accumulation measurement.
ACCUMULATION_PROMPT: Final[str] = (
    "Write a very long, detailed report on the history of astronomy, from ancient "
    "civilizations to modern space telescopes. Describe the key people, instruments and "
    "discoveries of every era, and explain why each discovery mattered."
)
