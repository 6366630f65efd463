"""The emulated crossover map's rounds: planning and running items, their records, confirmation and audit."""
