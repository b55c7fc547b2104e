//! The handshake's challenge–response: each end of a new connection proves it knows the
//! run's shared secret (`MOLD_DIST_SECRET`) without sending it.
//!
//! The connecting process sends a fresh nonce in its [`super::wire::Hello`]; the
//! accepting process answers with a nonce of its own and its proof; the connecting
//! process checks that proof before it sends its own (a process that does not know the
//! secret learns no proof from a real process by posing as the one it connects to). A
//! proof is HMAC-SHA256 keyed by the secret over [`LABEL`], the prover's side, the
//! prover's nonce, the other's nonce and the handshake's body (rank, world size, port,
//! what it runs): a proof taken from one connection fails on any other (the other end's
//! nonce is new), and a proof sent one way fails the other way (the side differs).
//! Without a secret (a loopback master only) the key is empty: the exchange still checks
//! that both ends agree there is none. Proofs are compared in constant time.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof.
pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) const PROOF_BYTES: usize = 32;

/// What every proof starts with; bumped with the protocol.
const LABEL: &[u8] = b"mold-dist v2 handshake";

pub(crate) type Nonce = [u8; NONCE_BYTES];

/// Which end of a connection proves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The process that connected (it sent the handshake).
    Connecting,
    /// The process that accepted the connection.
    Accepting,
}

/// A fresh random nonce (the thread's CSPRNG, seeded from the operating system).
pub(crate) fn nonce() -> Nonce {
    rand::random()
}

/// The MAC of one proof, before it is finalized or verified.
fn mac(secret: Option<&str>, side: Side, own: &Nonce, other: &Nonce, hello: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: `new_from_slice` cannot fail for it.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.unwrap_or("").as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    m.update(LABEL);
    m.update(&[match side {
        Side::Connecting => b'C',
        Side::Accepting => b'A',
    }]);
    m.update(own);
    m.update(other);
    m.update(&(hello.len() as u64).to_le_bytes());
    m.update(hello);
    m
}

/// `side`'s proof: it knows `secret`, on the connection of nonces `own` (its own) and
/// `other`, whose handshake body is `hello`.
pub(crate) fn prove(
    secret: Option<&str>,
    side: Side,
    own: &Nonce,
    other: &Nonce,
    hello: &[u8],
) -> [u8; PROOF_BYTES] {
    mac(secret, side, own, other, hello)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is `side`'s proof (its nonce `theirs`, the checker's `ours`), compared
/// in constant time.
pub(crate) fn verify(
    secret: Option<&str>,
    side: Side,
    theirs: &Nonce,
    ours: &Nonce,
    hello: &[u8],
    proof: &[u8],
) -> bool {
    mac(secret, side, theirs, ours, hello)
        .verify_slice(proof)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_for_its_connection_only() {
        let (c, a) = (nonce(), nonce());
        assert_ne!(c, a, "nonces are random");
        let hello = b"rank=1";
        let p = prove(Some("s"), Side::Connecting, &c, &a, hello);
        assert!(verify(Some("s"), Side::Connecting, &c, &a, hello, &p));
        // Another secret, none, another nonce of the checker (a replay), another body.
        assert!(!verify(Some("t"), Side::Connecting, &c, &a, hello, &p));
        assert!(!verify(None, Side::Connecting, &c, &a, hello, &p));
        assert!(!verify(
            Some("s"),
            Side::Connecting,
            &c,
            &nonce(),
            hello,
            &p
        ));
        assert!(!verify(Some("s"), Side::Connecting, &c, &a, b"rank=2", &p));
        // Reflected: the accepting side's proof does not pass as the connecting side's,
        // with the nonces either way round.
        let q = prove(Some("s"), Side::Accepting, &a, &c, hello);
        assert!(verify(Some("s"), Side::Accepting, &a, &c, hello, &q));
        assert!(!verify(Some("s"), Side::Connecting, &c, &a, hello, &q));
        assert!(!verify(Some("s"), Side::Connecting, &a, &c, hello, &q));
        // Truncated or empty proofs fail.
        assert!(!verify(
            Some("s"),
            Side::Connecting,
            &c,
            &a,
            hello,
            &p[..31]
        ));
        assert!(!verify(Some("s"), Side::Connecting, &c, &a, hello, &[]));
        // No secret on both ends agrees; on one end only, it does not.
        let n = prove(None, Side::Connecting, &c, &a, hello);
        assert!(verify(None, Side::Connecting, &c, &a, hello, &n));
        assert!(!verify(Some("s"), Side::Connecting, &c, &a, hello, &n));
    }
}
