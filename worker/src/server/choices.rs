//! The engine requests behind one HTTP request: one per choice (`n`), their tokens on one
//! channel, each request aborted as soon as its choice is closed on this side and all of them
//! when the response is dropped (the client left), so no KV block outlives its use.

use super::engine_loop::Command;
use super::generation::Prepared;
use super::http::Context;
use crate::engine::{EngineError, NewRequest, TokenOutput};
use crate::request::RequestId;
use kvgate_protocol::{ApiError, ErrorKind};
use std::sync::atomic::Ordering;
use tokio::sync::{mpsc, oneshot};

pub struct Choices {
    commands: mpsc::Sender<Command>,
    /// The engine request of each choice, by index.
    ids: Vec<RequestId>,
    /// Choices still wanted by the response.
    open: Vec<bool>,
    /// Choices whose request the engine still runs (a stop string closes a choice here first).
    running: Vec<bool>,
    tokens: mpsc::Receiver<TokenOutput>,
    /// A token taken from the channel before its turn.
    early: Option<TokenOutput>,
}

/// Why choices could not start.
pub enum StartError {
    Engine(EngineError),
    Stopped,
}

impl From<StartError> for ApiError {
    fn from(e: StartError) -> ApiError {
        match e {
            StartError::Engine(e) => super::http::engine_error(e),
            StartError::Stopped => ApiError::new(ErrorKind::Unavailable, "the engine has stopped"),
        }
    }
}

impl Choices {
    /// Adds the first choice's request and, once its prompt is computed (its first token has
    /// come), the others: the prompt's full blocks are in the prefix cache by then, so every
    /// choice shares them instead of computing the prompt again.
    pub async fn start(ctx: &Context, prepared: &Prepared) -> Result<Choices, StartError> {
        let n = prepared.n.max(1) as usize;
        let first = ctx.next_id.fetch_add(n as u64, Ordering::Relaxed);
        let capacity = n * (prepared.params.max_tokens as usize + 1);
        let (tx, tokens) = mpsc::channel(capacity);
        let mut choices = Choices {
            commands: ctx.commands.clone(),
            ids: Vec::with_capacity(n),
            open: Vec::with_capacity(n),
            running: Vec::with_capacity(n),
            tokens,
            early: None,
        };
        choices.add(prepared, first, &tx).await?;
        if n > 1 {
            choices.early = Some(choices.tokens.recv().await.ok_or(StartError::Stopped)?);
            for i in 1..n as u64 {
                choices.add(prepared, first + i, &tx).await?;
            }
        }
        Ok(choices)
    }

    async fn add(
        &mut self,
        prepared: &Prepared,
        id: RequestId,
        tx: &mpsc::Sender<TokenOutput>,
    ) -> Result<(), StartError> {
        let index = self.ids.len() as u64;
        let mut params = prepared.params.clone();
        // Choices with one seed would all draw the same tokens.
        params.seed = params.seed.map(|s| s.wrapping_add(index));
        let request = NewRequest {
            id,
            prompt: prepared.prompt.clone(),
            params,
            priority: 0,
        };
        let (reply, replied) = oneshot::channel();
        let command = Command::Add {
            request,
            tokens: tx.clone(),
            reply,
        };
        self.commands
            .send(command)
            .await
            .map_err(|_| StartError::Stopped)?;
        replied
            .await
            .map_err(|_| StartError::Stopped)?
            .map_err(StartError::Engine)?;
        self.ids.push(id);
        self.open.push(true);
        self.running.push(true);
        Ok(())
    }

    /// The next token of an open choice, with the choice's index; `None` when the engine
    /// dropped every request that was left.
    pub async fn next(&mut self) -> Option<(usize, TokenOutput)> {
        loop {
            let token = match self.early.take() {
                Some(t) => t,
                None => self.tokens.recv().await?,
            };
            let Some(index) = self.ids.iter().position(|&id| id == token.id) else {
                continue;
            };
            if token.finished.is_some() {
                self.running[index] = false;
            }
            if self.open[index] {
                return Some((index, token));
            }
        }
    }

    /// The response needs no more of choice `index`: the engine stops it now if it has not.
    pub fn close(&mut self, index: usize) {
        self.open[index] = false;
        if std::mem::take(&mut self.running[index]) {
            let _ = self.commands.try_send(Command::Abort(self.ids[index]));
        }
    }

    pub fn all_closed(&self) -> bool {
        !self.open.contains(&true)
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// The first choice's engine request, which names the response.
    pub fn first_id(&self) -> RequestId {
        self.ids[0]
    }
}

impl Drop for Choices {
    fn drop(&mut self) {
        for (id, running) in self.ids.iter().zip(&self.running) {
            if *running {
                let _ = self.commands.try_send(Command::Abort(*id));
            }
        }
    }
}
