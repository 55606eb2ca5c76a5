//! Training: AdamW, schedules and clipping ([`optim`]), the training loop that drives the model over
//! the data and writes a run directory ([`trainer`]), and the throughput bench ([`bench`]).

pub mod optim;
