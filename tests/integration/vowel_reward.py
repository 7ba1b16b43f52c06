"""A custom reward (verl's custom_reward_function signature) that a tiny random model can learn within a few PPO
steps: the share of vowels among the response's letters. A near-uniform random policy scores about 0.3 with
plenty of spread between samples, so PPO has signal from the first step."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    letters = [ch for ch in solution_str.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / max(len(letters), 1)
