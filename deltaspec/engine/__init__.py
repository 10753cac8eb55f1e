"""The engine: sequences, scheduler, runner, and the step loop that ties them together."""
