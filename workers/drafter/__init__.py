"""Online EAGLE drafter training: data buffer, objective, preemptible trainer."""
