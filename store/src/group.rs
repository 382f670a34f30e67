//! Group commit: many callers' small writes in one transaction.
//!
//! A fleet of 1,000 agents sends thousands of receipt batches and hundreds of rank reports a
//! second, each stored before it is acknowledged. One transaction each (a fence check, and a
//! commit that waits for the disk) caps the fleet at the disk's commit rate. Instead, writes
//! that arrive while one transaction commits wait together, and the next caller to take the
//! writer's turn writes all of them in one transaction: one fence check, one commit. Each
//! caller still gets its own answer, and returns only once its write has committed (or
//! failed), so nothing is acknowledged before it is durable.

use tokio::sync::oneshot;

use crate::{Result, StoreError};

/// The writes of one kind waiting for a turn, and the turn.
#[derive(Debug)]
pub(crate) struct Group<T> {
    queue: std::sync::Mutex<Vec<T>>,
    /// Held by the caller that is writing a group.
    writer: tokio::sync::Mutex<()>,
}

impl<T> Default for Group<T> {
    fn default() -> Self {
        Group { queue: Default::default(), writer: Default::default() }
    }
}

/// Where a queued write's answer goes.
pub(crate) type Answer<R> = oneshot::Sender<Result<R>>;

impl<T> Group<T> {
    /// Queues the write `make` builds around its answer's sender. The caller then waits with
    /// [`Waiter::next`], and writes the groups it is handed until its own answer comes:
    ///
    /// ```ignore
    /// let mut waiter = self.group.enqueue(|done| Pending { .., done });
    /// loop {
    ///     match waiter.next().await {
    ///         Next::Answered(result) => return result,
    ///         Next::Write(group) => write_group(self, group).await, // answers every write
    ///     }
    /// }
    /// ```
    pub(crate) fn enqueue<R>(&self, make: impl FnOnce(Answer<R>) -> T) -> Waiter<'_, T, R> {
        let (done, answer) = oneshot::channel();
        self.queue().push(make(done));
        Waiter { group: self, answer, turn: None }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Vec<T>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A queued write's caller, waiting for its answer or for the writer's turn.
pub(crate) struct Waiter<'a, T, R> {
    group: &'a Group<T>,
    answer: oneshot::Receiver<Result<R>>,
    /// The writer's turn while the caller writes a group it was handed.
    turn: Option<tokio::sync::MutexGuard<'a, ()>>,
}

/// What a waiting caller does next.
pub(crate) enum Next<T, R> {
    /// Its write was committed (or failed): the answer.
    Answered(Result<R>),
    /// It has the writer's turn: these writes (its own among them, or the ones queued after
    /// another caller's group) are its to write, in one transaction, answering each.
    Write(Vec<T>),
}

impl<T, R> Waiter<'_, T, R> {
    /// Ends a turn taken before, then waits for the answer or the next turn.
    pub(crate) async fn next(&mut self) -> Next<T, R> {
        self.turn = None;
        loop {
            tokio::select! {
                biased;
                result = &mut self.answer => {
                    return Next::Answered(result.unwrap_or_else(|_| Err(StoreError::Unavailable(
                        "the writer of a group of writes stopped before it committed".into(),
                    ))));
                }
                writer = self.group.writer.lock() => {
                    let group = std::mem::take(&mut *self.group.queue());
                    if !group.is_empty() {
                        self.turn = Some(writer);
                        return Next::Write(group);
                    }
                }
            }
        }
    }
}

/// Answers each write of a round written in one transaction: its own answer, or the
/// group's error. `done` takes a write's answer sender out of it.
pub(crate) fn answer_each<T, R>(round: Vec<T>, result: Result<Vec<R>>, done: impl Fn(T) -> Answer<R>) {
    match result {
        Ok(answers) => {
            for (write, answer) in round.into_iter().zip(answers) {
                let _ = done(write).send(Ok(answer));
            }
        }
        Err(e) => {
            for write in round {
                let _ = done(write).send(Err(copy_error(&e)));
            }
        }
    }
}

/// The same error for every write of a failed group: the fence keeps its kind (the core steps
/// down on it), anything else says what the database said.
fn copy_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Fenced(m) => StoreError::Fenced(m.clone()),
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        other => StoreError::Unavailable(other.to_string()),
    }
}
