"""Worker-side code: the torch rollout engine, the toy task, and drafter training."""
