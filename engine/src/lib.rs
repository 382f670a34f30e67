//! trainyard's built-in training engine: a nanochat-class GPT on tch.
//!
//! Empty until the engine issue fills it; jobs use the `exec` engine kind meanwhile, and the
//! controller refuses `builtin` jobs with a clear error rather than pretending to run them.
