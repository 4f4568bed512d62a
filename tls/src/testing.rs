//! Certificates for tests (rcgen): a CA, and leaves for servers and clients with chosen names,
//! URI SANs and validity. Only with the `testing` feature.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// A certificate authority.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
}

/// A certificate and its key, PEM.
pub struct Leaf {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its key, PEM.
    pub key_pem: String,
}

/// When a leaf is valid.
#[derive(Clone, Copy)]
pub enum Validity {
    /// 2020 to 2099.
    Now,
    /// 2020 to 2021.
    Expired,
    /// 2098 to 2099.
    NotYetValid,
}

impl Ca {
    /// A self-signed CA named `name`.
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf for `names` (DNS names or IPs) and `uris` (URI SANs), usable by servers and
    /// clients.
    pub fn leaf(&self, cn: &str, names: &[&str], uris: &[&str], validity: Validity) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        for u in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*u).try_into().unwrap()));
        }
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let (from, to) = match validity {
            Validity::Now => ((2020, 1, 1), (2099, 1, 1)),
            Validity::Expired => ((2020, 1, 1), (2021, 1, 1)),
            Validity::NotYetValid => ((2098, 1, 1), (2099, 1, 1)),
        };
        params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

impl Leaf {
    /// Writes `<name>.crt` and `<name>.key` under `dir`; returns their paths.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, &self.cert_pem).unwrap();
        std::fs::write(&key, &self.key_pem).unwrap();
        (cert, key)
    }

    /// The certificate, DER.
    pub fn der(&self) -> Vec<u8> {
        CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .unwrap()
            .to_vec()
    }
}
