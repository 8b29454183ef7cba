"""Evaluation: the task suite (`linattn eval --preset quick|paper`), associative recall
(`--preset recall`) and their reports."""
