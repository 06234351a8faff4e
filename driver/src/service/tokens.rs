//! The session each sandbox's current supervisor must open: its generation, session id and token.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use vm_contract::ids::SandboxId;
use vm_contract::session::{Generation, SessionHello, SessionId};

/// What one supervisor must present.
struct Expected {
    generation: Generation,
    session_id: SessionId,
    token: String,
}

/// Every sandbox's expected session. Its `Debug` shows no token.
#[derive(Default)]
pub struct SessionTokens {
    expected: Mutex<HashMap<SandboxId, Expected>>,
}

impl std::fmt::Debug for SessionTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTokens").finish_non_exhaustive()
    }
}

impl SessionTokens {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Expected>> {
        self.expected.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets what the next supervisor of `id` must present.
    pub fn expect(&self, id: &SandboxId, generation: Generation, session_id: SessionId, token: String) {
        self.lock().insert(id.clone(), Expected { generation, session_id, token });
    }

    /// Forgets `id` (it was deleted).
    pub fn forget(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// The sandbox whose expected session `hello` is, if it is one; the token compared in constant time.
    pub fn check(&self, hello: &SessionHello) -> Option<SandboxId> {
        let id = SandboxId::parse(&hello.sandbox_id).ok()?;
        let matches = self.lock().get(&id).is_some_and(|expected| {
            let t = &expected.token;
            expected.generation == hello.generation
                && expected.session_id == hello.session_id
                && t.len() == hello.token.len()
                && t.bytes().zip(hello.token.bytes()).fold(0, |acc, (a, b)| acc | (a ^ b)) == 0
        });
        matches.then_some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_expected_generation_session_and_token_pass() {
        let tokens = SessionTokens::default();
        let id = SandboxId::parse("a").unwrap_or_else(|e| panic!("{e}"));
        let session = SessionId::from_bytes([7; 16]);
        tokens.expect(&id, Generation(2), session.clone(), "secret".into());
        let hello = |generation, token: &str| SessionHello {
            sandbox_id: "a".into(),
            generation: Generation(generation),
            session_id: session.clone(),
            token: token.into(),
        };
        assert_eq!(tokens.check(&hello(2, "secret")), Some(id.clone()));
        assert_eq!(tokens.check(&hello(1, "secret")), None);
        assert_eq!(tokens.check(&hello(2, "secreT")), None);
        assert_eq!(tokens.check(&hello(2, "secre")), None);
        tokens.forget(&id);
        assert_eq!(tokens.check(&hello(2, "secret")), None);
    }
}
