"""The engine: memory planning and set-up, the scheduler, and the step loop (schedule -> execute -> update)."""
