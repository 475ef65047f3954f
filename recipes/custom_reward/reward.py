"""A custom reward for the recipe in this folder: the answer must come inside <answer> tags.

    reward = 1.0   when the response holds <answer>X</answer> and X equals the label
                   (vime's math equivalence: numbers within 1e-6, fractions, \\boxed{...})
           = 0.1   when the tags are there but X is wrong (the format alone earns a little)
           = 0.0   otherwise

vime calls it once per sample with the Sample (prompt, response, label, metadata) and expects
a number; it is named in config.yaml as `custom_rm_path: recipes.custom_reward.reward:tagged_answer`.
"""

from __future__ import annotations

import re

from vime_core.rewards.math_checker import is_equiv

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT_ONLY = 0.1


def tagged_answer(sample) -> float:
    found = ANSWER.findall(sample.response or "")
    if not found:
        return 0.0
    return 1.0 if is_equiv(found[-1].strip(), sample.label) else FORMAT_ONLY
