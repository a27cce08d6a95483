"""`dspark bench`: offline suite, lossless race, roofline and profile, serving load generator, reports.

Lives outside the core: the engine never imports this package."""
