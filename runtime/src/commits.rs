//! Answers committed to their stream's history in question order (what `vlmquery` calls
//! `commit-answers=ordered`), so that each question sees the conversation before it.
//!
//! Every answer has a [`CommitTurn`]. A question waits for the turn of the answer before it to
//! end ([`CommitTurn::wait`]), then reads the newest version at or after that answer's commit
//! (which [`Stream::commit`] appends after the newest frame registered then, so it may hold
//! frames newer than the question's own). Its own answer is committed through its turn
//! ([`CommitTurn::commit`]), and the turn ends ([`CommitTurn::end`]) once the answer has its
//! outcome, committed or not (failed, cancelled), so the next question never waits for nothing.
//! Which answer comes before which is the caller's order of questions.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::llama::Token;
use crate::stream::{Registration, Stream};

/// One answer's turn in the order its stream's answers are committed.
#[derive(Default)]
pub struct CommitTurn {
    state: Mutex<TurnState>,
    changed: Condvar,
}

#[derive(Default)]
struct TurnState {
    /// The answer has its outcome: the next question may go.
    ended: bool,
    /// The frame after which the answer was committed to the history.
    committed_after: Option<u64>,
}

impl CommitTurn {
    pub fn new() -> CommitTurn {
        CommitTurn::default()
    }

    /// Commit the question and its answer into `stream`'s history (after everything registered
    /// so far: [`Stream::commit`]), remembered for the question after this one.
    pub fn commit(
        &self,
        stream: &Arc<Stream>,
        question: &str,
        answer: &[Token],
        cancel: &AtomicBool,
    ) -> Result<Registration> {
        let registration = stream.commit(question, answer, cancel)?;
        self.committed(registration.number);
        Ok(registration)
    }

    /// The answer was committed after frame `number`.
    fn committed(&self, number: u64) {
        self.state.lock().committed_after = Some(number);
    }

    /// The answer has its outcome (committed or not): wake the question after it.
    pub fn end(&self) {
        self.state.lock().ended = true;
        self.changed.notify_all();
    }

    /// Wait, for the question after this answer, until the turn ends or `cancel` is set (then
    /// [`CommitTurn::wake`]). Returns the frame whose version that question reads: its own
    /// `frame`, or the frame this answer was committed after when that is newer.
    pub fn wait(&self, frame: u64, cancel: &AtomicBool) -> u64 {
        let mut state = self.state.lock();
        while !state.ended && !cancel.load(Ordering::Acquire) {
            self.changed.wait(&mut state);
        }
        state.committed_after.map_or(frame, |after| frame.max(after))
    }

    /// Wake the question waiting on this turn, so that it sees the cancel flag its caller has
    /// just set.
    pub fn wake(&self) {
        let _state = self.state.lock();
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_next_question_reads_the_newer_of_its_frame_and_the_commit() {
        let turn = CommitTurn::new();
        turn.committed(7);
        turn.end();
        let cancel = AtomicBool::new(false);
        assert_eq!(turn.wait(3, &cancel), 7);
        assert_eq!(turn.wait(9, &cancel), 9);
    }

    #[test]
    fn an_answer_not_committed_leaves_the_next_question_its_frame() {
        let turn = CommitTurn::new();
        turn.end();
        assert_eq!(turn.wait(4, &AtomicBool::new(false)), 4);
    }

    #[test]
    fn the_next_question_waits_until_the_turn_ends() {
        let turn = Arc::new(CommitTurn::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let turn = Arc::clone(&turn);
            std::thread::spawn(move || tx.send(turn.wait(1, &AtomicBool::new(false))).unwrap())
        };
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "returned before the turn ended");
        turn.committed(5);
        turn.end();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(5));
        waiter.join().unwrap();
    }

    #[test]
    fn a_cancelled_question_stops_waiting_when_woken() {
        let turn = Arc::new(CommitTurn::new());
        let cancel = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let (turn, cancel) = (Arc::clone(&turn), Arc::clone(&cancel));
            std::thread::spawn(move || tx.send(turn.wait(2, &cancel)).unwrap())
        };
        // Still waiting (the turn never ends): only the cancellation and the wake end it.
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err(), "returned before it was cancelled");
        cancel.store(true, Ordering::Release);
        turn.wake();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(2), "a woken cancelled wait must end");
        waiter.join().unwrap();
    }
}
